"""compiles.count_compiles: compilations counted by function name, inside the block only."""

import jax
import jax.numpy as jnp
from compiles import count_compiles


def test_counts_each_compile_of_a_function_by_name():
    def doubled(x):
        return 2 * x

    fn = jax.jit(doubled)
    with count_compiles() as compiles:
        fn(jnp.ones(3))
        fn(jnp.ones(3) + 1)  # the same shapes: no compile
        fn(jnp.ones(4))  # another shape: a second program
    assert compiles["doubled"] == 2
    assert compiles["never_compiled"] == 0
    fn(jnp.ones(5))  # after the block: not counted
    assert compiles["doubled"] == 2
