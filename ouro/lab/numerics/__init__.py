"""`ouro probe numerics` and `ouro probe vision`: two configurations on the same inputs, every
module, op and sub-computation tapped by token position, the first place past its tolerance."""
