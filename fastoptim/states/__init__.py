"""State formats (``formats``: fp32, bf16, float64, 8-bit blockwise, subset-norm) and the readable
reference code of the lean ones: 8-bit blockwise codes (``blockwise8``) and subset-norm partitions
(``subset_norm``)."""
