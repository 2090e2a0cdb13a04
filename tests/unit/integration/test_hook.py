"""The ``.pth`` hook: cheap at start-up, reaches LF, can be turned off, and guards LF's private names."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from llamafactory_qwenvl_patch.integration import lf_compat

ARGS = {
    "model_name_or_path": "unused",
    "stage": "sft",
    "do_train": True,
    "output_dir": "unused",
    "dataset": "unused",
    "qwenvl_patch": True,
}


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=300)


def printed(result: subprocess.CompletedProcess) -> list[str]:
    """The words of the line the snippet printed last: libraries may print their own lines first (DeepSpeed's
    accelerator notice, LF's version warning), which no environment variable should be able to break."""
    lines = result.stdout.strip().splitlines()
    return lines[-1].split() if lines else []


def test_interpreter_start_imports_nothing_heavy():
    result = python(
        "import sys; print(any(type(f).__name__ == 'PostImportFinder' for f in sys.meta_path), "
        "'torch' in sys.modules, 'llamafactory' in sys.modules, 'transformers' in sys.modules)"
    )
    assert printed(result) == ["True", "False", "False", "False"], result.stderr


PARSE = (
    "from llamafactory.hparams.parser import _parse_train_args; "
    f"m = _parse_train_args({ARGS!r})[0]; print(type(m).__name__, m.qwenvl_patch)"
)


def test_hook_widens_lf_arguments():
    result = python(PARSE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert printed(result)[-2:] == ["ModelArguments", "True"]


def test_disable_env_gives_stock_lf_which_rejects_the_key():
    """Stock LF refuses the key with an error that names it (its wording is LF's and transformers' business)."""
    code = ("from llamafactory.hparams.parser import _parse_train_args\n"
            f"try:\n    _parse_train_args({ARGS!r})\nexcept ValueError as exc:\n"
            "    print('rejected', 'qwenvl_patch' in str(exc))\nelse:\n    print('accepted')")
    result = python(code, QWENVL_PATCH_DISABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert printed(result)[-2:] == ["rejected", "True"]


def test_explicit_apply_after_lf_is_imported():
    code = (
        "import llamafactory.hparams.parser as p, llamafactory.model as m, llamafactory.data as d; "
        "from llamafactory_qwenvl_patch import apply; apply(); apply(); "
        f"print(p._parse_train_args({ARGS!r})[0].qwenvl_patch, "
        "getattr(m.load_tokenizer, '__qwenvl_wrapped__', False), "
        "getattr(d.get_template_and_fix_tokenizer, '__qwenvl_wrapped__', False), "
        "getattr(m.load_tokenizer.__wrapped__, '__qwenvl_wrapped__', False))"
    )
    result = python(code, QWENVL_PATCH_DISABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert printed(result) == ["True", "True", "True", "False"]


def test_missing_private_name_fails_loudly_with_version():
    module = types.ModuleType("llamafactory.data.template")
    with pytest.raises(lf_compat.LFCompatError, match=r"llamafactory 0\.9\.5: llamafactory\.data\.template has no TEMPLATES"):
        lf_compat.require(module, ["TEMPLATES"])


def test_pinned_template_is_a_copy_and_shared_plugin_untouched(tiny_model):
    from llamafactory.data.mm_plugin import Qwen2VLPlugin
    from llamafactory.data.template import TEMPLATES, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer
    from transformers import Qwen2VLImageProcessor

    from llamafactory_qwenvl_patch.integration.plugin import PinnedQwen2VLPlugin

    # transformers 5.6 writes a max_pixels argument into the class default (Qwen2VLImageProcessor(max_pixels=X)
    # changes every later Qwen2VLImageProcessor()), so an earlier test in this worker may have moved it already
    default = Qwen2VLImageProcessor().size["longest_edge"]
    model_args, data_args, *_ = get_train_args({**ARGS, "model_name_or_path": str(tiny_model),
                                                "template": "qwen2_vl", "image_max_pixels": 602112})
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    assert type(template.mm_plugin) is PinnedQwen2VLPlugin
    assert template.mm_plugin.qwenvl_max_pixels == 602112
    assert type(TEMPLATES["qwen2_vl"].mm_plugin) is Qwen2VLPlugin
    assert type(TEMPLATES["glm4v"].mm_plugin).__name__ == "GLM4VPlugin"
    assert module["processor"].image_processor.size["longest_edge"] == 602112
    assert Qwen2VLImageProcessor().size["longest_edge"] == default  # class default untouched by the pinning
