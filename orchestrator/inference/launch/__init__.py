"""Servers the run launches itself: their command lines (``spec``), their processes
(``process``, each tied to the worker's life by ``watchdog``) and their supervision
(``supervisor``: started, waited for, restarted with backoff, given up on, stopped).

Nothing is imported here: the watchdog, a process per server, starts with this package.
"""
