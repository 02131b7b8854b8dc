"""The built-in backend plugins of portable-kernels, one package per vendor.

They load through the ``portable_kernels`` entry-point group exactly as a third-party
backend would. Each holds detection, emulation profiles, variant registrations and tuning
configs; none holds a kernel body (those live in ``portable_kernels.kernels``).
"""
