"""Integrations with other libraries; each module imports its library only when used.

- :mod:`portable_kernels.integrations.transformers`: ``register()`` makes
  ``attn_implementation="portable_kernels"`` run Hugging Face models' attention through
  the ``flash_attn`` kernel (install the ``transformers`` extra).
"""
