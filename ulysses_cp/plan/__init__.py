"""Planning a run before launch: memory, communication and step time per candidate."""
