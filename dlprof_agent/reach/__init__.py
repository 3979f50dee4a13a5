"""Reaching into a process: the injectors, one module per mechanism behind ``inject``:
``ptrace`` (x86-64), ``gdb`` (elsewhere), and for Python 3.14+ (PEP 768)
``remote_exec`` (the agent's own ``sys.remote_exec``) and ``remote_debug`` (the same
protocol through the job's ``debug_offsets``), with the ELF checks that come first
(``elf``, ``runtime``). Each is handed the job as a ``Target`` (``collectors/target.py``)
and reads it through the injector's /proc front (``procfs``)."""
