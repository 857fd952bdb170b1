from .int8 import (QMAX, dequantize, int8_mm_chunked, int8_mm_naive, quantize_rows, w8a8_experts_naive,
                   w8a8_linear_naive)

__all__ = ["QMAX", "dequantize", "int8_mm_chunked", "int8_mm_naive", "quantize_rows", "w8a8_experts_naive",
           "w8a8_linear_naive"]
