"""`ouro probe leaks`: one request down each engine path, every page, slot, checkpoint and record
accounted for, a leak placed where its path dropped the resource."""
