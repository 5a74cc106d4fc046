"""The worker's errors, torch-free: the API server's process catches them without the
worker itself (``engine.async_engine``, ``engine.multiprocess_engine``)."""


class DeviceError(RuntimeError):
    """The device failed in a way no later step can recover from."""
