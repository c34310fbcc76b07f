"""Stand-in for FlashAttention-4 4.0.0b18 (tests.support.flash_standin): flash_attn.cute."""
