"""A2A on the wire, sans I/O: values, codecs, the task state machine and JSON-RPC errors.

Imports only the standard library and attrs.
"""
