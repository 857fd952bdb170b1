"""`ouro probe redundancy`: the aten ops of a step recorded with their module, source line and
input identity: repeated ops, host syncs, each block's and weight's work against its floor."""
