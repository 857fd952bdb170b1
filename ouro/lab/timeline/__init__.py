"""`ouro probe timeline`: a traced scenario's spans per thread, their overlap, the engine loop's
idle gaps and GIL starvation."""
