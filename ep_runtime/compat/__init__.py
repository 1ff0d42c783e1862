"""APIs of other expert-parallel libraries, served by ep-runtime (``deep_ep``: DeepEP's Buffer)."""
