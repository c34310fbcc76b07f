"""Models that hold no parallel code (attention is injected): the reference ``decoder``,
Hugging Face models (``hf``), sequence-parallel losses (``loss``) and the memory features
(``memory``: tiled MLP and loss, activation checkpointing and offload)."""
