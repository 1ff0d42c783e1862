"""Starting processes: the only place in ep-runtime that does. ``local`` runs workers on this
machine (torchrun's elastic agent, standalone rendezvous); ``ray`` runs them as Ray actors on a Ray
cluster. Both give each worker torchrun's environment and return the workers' results by rank;
``start.start_workers`` picks one by name. ``cli`` is the ``ep-runtime`` command, which starts the
training job and the multi-process benchmarks through them. Multi-node torchrun needs no launcher
of ours (``torchrun ... -m ep_runtime.train``). The runtime (``ep_runtime``) imports nothing of
this package."""
