"""``qwenvl-prep``: convert, check, draw and evaluate Qwen-VL grounding data in the frame the model sees."""
__version__ = "0.1.0"
