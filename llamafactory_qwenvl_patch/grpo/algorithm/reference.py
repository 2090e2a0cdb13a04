"""The KL reference for LoRA runs: the model the run starts from, also when it starts from an SFT adapter.

LF resumes the last ``adapter_name_or_path`` as the trainable adapter when ``create_new_adapter`` is false, and
always under ZeRO-3 or quantisation (it cannot merge there). ``disable_adapter()`` would then remove the SFT
adapter from the reference as well and pull the policy back to the pre-SFT base. So the resumed adapter is loaded a
second time, frozen, as ``grpo_reference``, and the reference forward runs with that adapter active. When LF merged
every adapter into the base and created a new one, disabling the adapter gives the starting model, as before.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, ContextManager, Iterator

REFERENCE_ADAPTER = "grpo_reference"


@contextmanager
def record_trainable_adapter_loads() -> Iterator[list[str]]:
    """Collect the adapter folders that peft loads as trainable while LF builds the model (what LF resumed)."""
    from peft import PeftModel

    original = PeftModel.__dict__["from_pretrained"]
    loaded: list[str] = []

    def from_pretrained(cls, model, model_id, *args, is_trainable: bool = False, **kwargs):
        if is_trainable:
            loaded.append(str(model_id))
        return original.__func__(cls, model, model_id, *args, is_trainable=is_trainable, **kwargs)

    PeftModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield loaded
    finally:
        PeftModel.from_pretrained = original


def add_reference_adapter(model: Any, adapter_path: str, subfolder: str | None = None) -> None:
    """Load ``adapter_path`` again as a frozen adapter; the trainable adapter and its parameters stay as they are
    (peft freezes every adapter and switches the model to eval mode when it loads a frozen one: both are undone)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    kwargs = {"subfolder": subfolder} if subfolder else {}
    model.load_adapter(adapter_path, adapter_name=REFERENCE_ADAPTER, is_trainable=False, **kwargs)
    model.train()
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    now = [name for name, p in model.named_parameters() if p.requires_grad]
    if any(f".{REFERENCE_ADAPTER}." in name for name in now) or model.active_adapter == REFERENCE_ADAPTER:
        raise RuntimeError("the GRPO reference adapter became trainable or active; this peft version is not "
                           "supported by stage: grpo")


@contextmanager
def _reference_adapter_active(model: Any) -> Iterator[None]:
    active = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.base_model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
    try:
        yield
    finally:
        model.base_model.set_adapter(active)
        for param, flag in flags:
            param.requires_grad_(flag)


def reference_context(model: Any) -> ContextManager[None]:
    """Within it, the (unwrapped) policy model computes the reference: the frozen starting adapter, the model
    without its new adapter, or (for a separate reference model) the model itself."""
    peft_config = getattr(model, "peft_config", None)
    if peft_config and REFERENCE_ADAPTER in peft_config:
        return _reference_adapter_active(model)
    if hasattr(model, "disable_adapter"):
        return model.disable_adapter()
    return nullcontext()


@contextmanager
def saving_trained_adapter_only(model: Any) -> Iterator[None]:
    """Checkpoints keep the trained adapter at their root only, as LF and Trainer's resume expect."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config or REFERENCE_ADAPTER not in peft_config:
        yield
        return
    model.save_pretrained = partial(type(model).save_pretrained, model, selected_adapters=[model.active_adapter])
    try:
        yield
    finally:
        del model.save_pretrained
