"""Quantisation applied to a built model (`--quantization`): W8A8 int8 projections and experts
(`w8a8`), the int8 products this machine runs (`int8_forms`, ouro's kernel `int8_native`)."""
