"""What other libraries' own calls of a jitted model vary, so that capture can make it symbolic.

``huggingface``: the calls ``transformers``' ``generate()`` makes of the model's forward.
"""
