"""The parameter server: the layers below training.

Pure modules first (``layout``, ``placement``, ``protocol``, ``tables``, ``checkpoint``,
``signals``: no MPI), then ``transport``, the only module that talks to MPI, then the server
(``server``) and the worker's side (``client``, ``context``), which reach MPI only through it.
"""
