"""The engine: the front end and the engine core around the worker.

- front end (the API server's process): ``frontend`` (``InputProcessor`` of
  ``input_processor``: tokenise and validate once; ``OutputProcessor`` of
  ``output_processor``: detokenise, stop strings, deltas), driven in process (``engine``),
  on a thread for asyncio (``async_engine``), or over ZMQ to cores in their own processes
  (``multiprocess_engine``, ``core_process``);
- the engine core (``core``): the scheduler and the token budget (``scheduling``) around
  the worker (``worker``), with the KV transfers of disaggregation (``disagg``); its
  statistics per step (``step_log``)."""
