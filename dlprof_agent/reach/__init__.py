"""Reaching into a process: the injectors, one module per mechanism behind ``inject``:
``ptrace`` (x86-64), ``gdb`` (elsewhere), and for Python 3.14+ (PEP 768)
``remote_exec`` (the agent's own ``sys.remote_exec``) and ``remote_debug`` (the same
protocol through the job's ``debug_offsets``), with the checks that come first (the
ELF checks ``elf`` and ``runtime``, ``refusal`` and ``shutdown``). Each is handed
the job as a ``Target`` (``collectors/target.py``) and reads it through the
injector's /proc front (``procfs``). Finding, starting and keeping the probe once
it is in is ``probe_link``'s."""
