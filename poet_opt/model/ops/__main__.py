"""``python -m poet_opt.model.ops``: print the operator support table docs/operators.md holds."""

from poet_opt.model.ops.support import table

print(table(), end="")
