"""What the scheduler reads and writes, in pure Python (no torch): requests as counters
(``request``) and their public ``SamplingParams`` (``sampling_params``), the iteration-level
``scheduler``, the paged KV-cache bookkeeping (``kv_cache``), each step's token ``budget``
and the step-time ``costmodel`` it is chosen from, and how decodes are grouped
(``decode_groups``). The engine core drives it; the worker reads its records
(``SchedulerOutput``, ``Request``); it imports neither."""
