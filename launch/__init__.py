"""Starting processes: the only place in ep-runtime that does. ``local`` runs workers on this
machine (torchrun's elastic agent, standalone rendezvous)."""
