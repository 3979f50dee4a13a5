"""The commands: one module per command, each with its parser and ``run``; main.py
builds the parser from them and hands each command line to its module."""
