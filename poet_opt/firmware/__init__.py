"""Firmware stage: a validated schedule laid out for a microcontroller (static arena, flash offsets),
re-solved until it fits, and written as a C header."""
