"""The operations of the Python API, one module each (re-exported by ``ckptool``)."""
