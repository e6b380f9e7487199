"""Bits per byte and token perplexity of a causal LM over whole documents: an `evaluate` metric module.

    import evaluate
    bpb = evaluate.load("metrics/bits_per_byte")  # from the repository root; works with HF_HUB_OFFLINE=1
    bpb.compute(predictions=texts, model="outputs/tiny/final", lengths=[512, 4096])
    bpb.compute(predictions=texts, model=model, tokenizer=tokenizer, lengths=512)

The scoring is ``training.evaluate.evaluate_model`` (the same code as ``python -m training.evaluate``; the package
must be importable: ``pip install -e .`` or run from the repository root). ``predictions`` are the documents. At
evaluation length L each document (``[bos] + tokens(text)``) is cut into consecutive windows of L input tokens and
every text token is scored once. Reported per length: ``bits_per_byte = sum NLL / (ln 2 * UTF-8 bytes)``,
``ppl_token = exp(sum NLL / tokens)``, ``ppl_word`` (whitespace-separated words).

``model`` is a loaded causal LM, or a folder / Hub id loaded with ``AutoModelForCausalLM`` (BST folders need no
flag; other custom architectures take ``trust_remote_code=True``, which the Hub's "perplexity" metric cannot pass).
"""

import datasets
import evaluate

from training.evaluate import evaluate_model, load_model  # From: -e <repository root> (this repository's package)


_CITATION = ""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): the documents to score.
    model (`PreTrainedModel` or `str`): a causal LM, or a folder / Hub id to load.
    tokenizer (*optional*): the tokenizer (default: loaded from ``model`` when it is a path).
    lengths (`int` or `list[int]`, defaults to 512): evaluation length(s) L in tokens.
    chunk_size (`int`, defaults to 0): feed each window in chunks of this many tokens, cache carried (0: whole).
    carry_state (`bool`, defaults to False): carry the cache from one window to the next inside a document.
    batch_size (`int`, defaults to 1): windows per forward.
    max_tokens_per_doc (`int`, *optional*): score only each document's first N text tokens.
    device (`str`, *optional*), dtype (`str`, defaults to "float32"), trust_remote_code (`bool`): for a path.
Returns:
    `dict` with per-length lists ``lengths``, ``bits_per_byte``, ``ppl_token``, ``ppl_word`` and ``results``, the
    full rows of ``training.evaluate`` (NLL sum, tokens, bytes, words, windows; ``error`` for a length the model
    cannot run).
Examples:
    >>> bpb = evaluate.load("metrics/bits_per_byte")
    >>> out = bpb.compute(predictions=["Some text."], model="outputs/tiny/final", lengths=[64, 128])
    >>> sorted(out)
    ['bits_per_byte', 'lengths', 'ppl_token', 'ppl_word', 'results']
"""


@evaluate.utils.file_utils.add_start_docstrings(__doc__, _KWARGS_DESCRIPTION)
class BitsPerByte(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(
        self,
        predictions,
        model,
        tokenizer=None,
        lengths=512,
        chunk_size: int = 0,
        carry_state: bool = False,
        batch_size: int = 1,
        max_tokens_per_doc=None,
        device=None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
    ):
        if isinstance(model, str):
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model, loaded_tokenizer = load_model(model, device, dtype, trust_remote_code=trust_remote_code)
            tokenizer = tokenizer or loaded_tokenizer
        elif tokenizer is None:
            raise ValueError("bits_per_byte: pass the tokenizer along with a loaded model")
        elif device is not None:
            model = model.to(device)
        lengths = [lengths] if isinstance(lengths, int) else list(lengths)
        rows = evaluate_model(
            model,
            tokenizer,
            list(predictions),
            lengths,
            chunk_size=chunk_size,
            carry_state=carry_state,
            batch_size=batch_size,
            max_tokens_per_doc=max_tokens_per_doc,
        )
        return {
            "lengths": lengths,
            "bits_per_byte": [r.get("bits_per_byte") for r in rows],
            "ppl_token": [r.get("ppl_token") for r in rows],
            "ppl_word": [r.get("ppl_word") for r in rows],
            "results": rows,
        }
