"""The parameter server: the layers below training.

Pure modules first (``layout``, ``placement``, ``protocol``, ``tables``, ``checkpoint``,
``signals``; a server's table shards: ``store`` (keys and rows), ``policies`` (admission, eviction,
memory budget), ``server_table`` (the two composed), ``consistency`` (worker clocks, what waits on
them), ``margins`` (the server functions of computation on the servers): no MPI), then
``transport``, the only module that talks to MPI, then the server (``server``) and the worker's side
(``client``, ``context``), which reach MPI only through it.
"""
