from .fp8 import E4M3, FP8_MAX, fp8_linear_naive, quantize_rows_fp8
from .int8 import (QMAX, dequantize, int8_mm_chunked, int8_mm_naive, quantize_rows, w8a8_experts_naive,
                   w8a8_linear_naive)

__all__ = ["E4M3", "FP8_MAX", "QMAX", "dequantize", "fp8_linear_naive", "int8_mm_chunked", "int8_mm_naive",
           "quantize_rows", "quantize_rows_fp8", "w8a8_experts_naive", "w8a8_linear_naive"]
