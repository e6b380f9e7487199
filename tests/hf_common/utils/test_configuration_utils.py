"""Stand-in for transformers' tests/utils/test_configuration_utils.py (a repository-only module), always ours.

``ConfigTester.check_config_arguments_init`` builds the config from these general ``PreTrainedConfig`` arguments,
each set to a non-default value, and checks that every one is kept. Written here from the fields of the installed
``transformers.PreTrainedConfig`` (the repository's module needs the repository's ``utils/test_module`` package,
which neither the source release nor the fetched ``tests/`` folders carry).
"""

config_common_kwargs = {
    "architectures": ["BSTForCausalLM"],
    "output_hidden_states": True,
    "output_attentions": True,
    "return_dict": False,
    "dtype": "float16",
    "chunk_size_feed_forward": 3,
    "id2label": {0: "negative", 1: "positive"},
    "label2id": {"negative": 0, "positive": 1},
    "problem_type": "single_label_classification",
}
