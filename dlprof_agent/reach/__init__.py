"""Reaching a process: the target pid checked (``target``), the probe in it found or
injected and kept (``connect``, ``channel``), and the injectors, one module per
mechanism behind ``inject``: ``ptrace`` (x86-64), ``gdb`` (elsewhere) and
``remote_exec`` (Python 3.14+), with the ELF checks that come first (``elf``,
``runtime``)."""
