"""Stand-in for transformers' tests/exporters/test_export.py, used when the repository's file cannot be had.

``ModelTesterMixin`` inherits ``ExportTesterMixin``. The repository's mixin exports every model class through
transformers' exporters (torch.export, ONNX, ExecuTorch) and compares the outputs with eager. This stand-in keeps
the torch.export check: ``torch.export.export`` of each model class on the tester's inputs, and the exported
program's outputs equal eager outputs.
"""

import copy

import torch
from transformers.testing_utils import torch_device


class ExportTesterMixin:
    def test_torch_export(self, atol=1e-4, rtol=1e-4):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(copy.deepcopy(config)).to(torch_device).eval()
            inputs = self._prepare_for_class(inputs_dict, model_class)
            inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            if "use_cache" in _params(model):
                inputs["use_cache"] = False
            with torch.no_grad():
                eager = _flatten(model(**inputs))
                try:
                    program = torch.export.export(model, args=(), kwargs=inputs, strict=False)
                except Exception as error:
                    raise AssertionError(f"torch.export of {model_class.__name__} failed: {error!r}") from error
                exported = _flatten(program.module()(**inputs))
            eager = [t for t in eager if isinstance(t, torch.Tensor)]
            exported = [t for t in exported if isinstance(t, torch.Tensor)]
            self.assertEqual(len(exported), len(eager), model_class.__name__)
            for a, b in zip(eager, exported):
                name = model_class.__name__
                torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def _params(model):
    import inspect

    return inspect.signature(model.forward).parameters


def _flatten(output):
    if hasattr(output, "to_tuple"):
        return list(output.to_tuple())
    if isinstance(output, (tuple, list)):
        return list(output)
    if isinstance(output, dict):
        return list(output.values())
    return [output]
