"""Hadamard matrices of the orders decoder widths have, and the orthogonal rotations qtk builds from them.

A Hadamard matrix H of order n has entries ±1 and H Hᵀ = n I, so H/√n is orthogonal: rotating a layer's input by it
spreads an outlier channel over all n channels (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024). Orders are
built from three classical constructions, chosen by `construction(n)`:

  Sylvester   H(2m) = [[H(m), H(m)], [H(m), -H(m)]]                          (m = 1: order 2)
  Paley I     q ≡ 3 (mod 4) a prime power: H(q + 1) = I + [[0, 1ᵀ], [-1, Q]]
  Paley II    q ≡ 1 (mod 4) a prime power: H(2q + 2) from C = [[0, 1ᵀ], [1, Q]] as
              C ⊗ [[1, -1], [-1, -1]] + I ⊗ [[1, 1], [1, -1]]
  Kronecker   H(ab) = H(a) ⊗ H(b)

with Q the Jacobsthal matrix of GF(q), Q[a, b] = χ(a - b) (χ the quadratic character). A width 2^k · m (m odd) is
a Kronecker product of a Paley core of order 2^j · m and Sylvester's 2^(k-j), the core as small as it comes:
576 = 36 ⊗ 16 (Paley II on 17), 1536 = 12 ⊗ 128 (Paley I on 11), 14336 = 28 ⊗ 512 (Paley I on GF(27)). An order none of these reaches (92, 184, or a width
that 4 does not divide) gets a block-diagonal rotation: H(b)/√b on each block of the largest order b that divides n
and can be built (`Rotation.block`), orthogonal still, as QuaRot and compressed-tensors' head_dim schemes do.

A rotation is applied by its factors (x reshaped so each factor acts on one axis), so the 14336-wide ones never
exist as one dense matrix. Randomised Hadamard: R = D H/√n, D = diag(±1) drawn from a recorded seed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from qtk.quant.lazy import torch

# a power-of-two factor larger than this is split into several (each factor is one dense matrix while applied)
MAX_DENSE_FACTOR = 1024


# ---------------------------------------------------------------------------------------------- finite fields

def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, e) with q = p^e for a prime p, else None."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    e = 0
    while q % p == 0:
        q //= p
        e += 1
    return (p, e) if q == 1 else None


def _polymulmod(a: list[int], b: list[int], f: list[int], p: int) -> list[int]:
    """a·b mod the monic f over GF(p); polynomials as coefficient lists, lowest degree first, len(f) - 1 long."""
    e = len(f) - 1
    prod = [0] * (2 * e - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                prod[i + j] = (prod[i + j] + x * y) % p
    for k in range(len(prod) - 1, e - 1, -1):  # reduce by x^e = -(f[0] + ... + f[e-1] x^(e-1))
        c = prod[k]
        if c:
            for j in range(e):
                prod[k - e + j] = (prod[k - e + j] - c * f[j]) % p
    return prod[:e]


def _irreducible(p: int, e: int) -> list[int]:
    """The first monic polynomial of degree e irreducible over GF(p) (coefficients lowest first): it has no monic
    factor of degree 1..e/2, tested by division."""
    def divides(g: list[int], f: list[int]) -> bool:
        r = list(f)
        for k in range(len(r) - 1, len(g) - 2, -1):
            c = r[k]
            if c:
                for j in range(len(g)):
                    r[k - len(g) + 1 + j] = (r[k - len(g) + 1 + j] - c * g[j]) % p
        return not any(r[: len(g) - 1])

    def monic(d: int):
        for n in range(p ** d):
            yield [(n // p ** i) % p for i in range(d)] + [1]

    for f in monic(e):
        if not any(divides(g, f) for d in range(1, e // 2 + 1) for g in monic(d)):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {e} over GF({p})")  # there always is one


@functools.lru_cache(maxsize=None)
def _jacobsthal(q: int) -> "torch.Tensor":
    """Q[a, b] = χ(a - b) over GF(q), elements numbered by their coefficients in base p; int8 [q, q]."""
    p, e = _prime_power(q)
    if e == 1:
        squares = {(x * x) % p for x in range(1, p)}
        chi = torch.tensor([0] + [1 if x in squares else -1 for x in range(1, p)], dtype=torch.int8)
        idx = torch.arange(q)
        return chi[(idx[:, None] - idx[None, :]) % q]
    f = _irreducible(p, e)
    digits = [[(n // p ** i) % p for i in range(e)] for n in range(q)]
    number = {tuple(d): n for n, d in enumerate(digits)}
    squares = {number[tuple(_polymulmod(d, d, f, p))] for d in digits[1:]}
    chi = torch.tensor([0] + [1 if n in squares else -1 for n in range(1, q)], dtype=torch.int8)
    d = torch.tensor(digits)  # [q, e]
    diff = (d[:, None, :] - d[None, :, :]) % p  # a - b, digit by digit
    return chi[(diff * torch.tensor([p ** i for i in range(e)])).sum(-1)]


# ---------------------------------------------------------------------------------------------- constructions

def _paley1(q: int) -> "torch.Tensor":
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.int8)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.int8)


def _paley2(q: int) -> "torch.Tensor":
    c = torch.zeros(q + 1, q + 1, dtype=torch.int8)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    a = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int8)
    b = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.int8), b)


def _sylvester(n: int) -> "torch.Tensor":
    h = torch.ones(1, 1, dtype=torch.int8)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def construction(n: int) -> tuple | None:
    """How H(n) is built, as a tree: ("sylvester", n) | ("paley1", q) | ("paley2", q) | ("kron", a, b); None when none
    of the constructions reaches n. Prefers one Paley core times a power of two (the core as small as it comes)."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return ("sylvester", n)
    if n % 4:
        return None
    pow2 = n & -n
    for k in range(2, pow2.bit_length()):  # core 2^j·m, j from 2 up: the smallest Paley core first
        core = (n // pow2) << k
        pq = _paley_core(core)
        if pq is not None:
            return pq if core == n else ("kron", pq, ("sylvester", n // core))
    for a in range(4, math.isqrt(n) + 1, 4):  # a product of two constructible orders, both multiples of 4
        if n % a == 0 and (n // a) % 4 == 0:
            ca, cb = construction(a), construction(n // a)
            if ca is not None and cb is not None:
                return ("kron", ca, cb)
    return None


def _paley_core(n: int) -> tuple | None:
    pp = _prime_power(n - 1)
    if pp is not None and (n - 1) % 4 == 3:
        return ("paley1", n - 1)
    if n % 2 == 0:
        pp = _prime_power(n // 2 - 1)
        if pp is not None and (n // 2 - 1) % 4 == 1:
            return ("paley2", n // 2 - 1)
    return None


def _order(c: tuple) -> int:
    kind = c[0]
    if kind == "sylvester":
        return c[1]
    if kind == "paley1":
        return c[1] + 1
    if kind == "paley2":
        return 2 * c[1] + 2
    return _order(c[1]) * _order(c[2])


def describe(c: tuple) -> str:
    """A construction as people write it, e.g. 'Paley II(71) ⊗ Sylvester(4)'."""
    kind = c[0]
    if kind == "kron":
        return f"{describe(c[1])} ⊗ {describe(c[2])}"
    return {"sylvester": "Sylvester", "paley1": "Paley I", "paley2": "Paley II"}[kind] + f"({c[1]})"


def _factors(c: tuple) -> list["torch.Tensor"]:
    """The ±1 factors whose Kronecker product is H (each dense, at most MAX_DENSE_FACTOR wide for powers of two)."""
    kind = c[0]
    if kind == "kron":
        return _factors(c[1]) + _factors(c[2])
    if kind == "paley1":
        return [_paley1(c[1])]
    if kind == "paley2":
        return [_paley2(c[1])]
    n, out = c[1], []
    while n > MAX_DENSE_FACTOR:
        out.append(_sylvester(MAX_DENSE_FACTOR))
        n //= MAX_DENSE_FACTOR
    return out + ([_sylvester(n)] if n > 1 or not out else [])


def hadamard_matrix(n: int) -> "torch.Tensor":
    """H(n), ±1 entries, int8 [n, n] (dense: meant for small orders and tests). ValueError when it cannot be built."""
    c = construction(n)
    if c is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (see largest_block)")
    h = torch.ones(1, 1, dtype=torch.int8)
    for f in _factors(c):
        h = torch.kron(h, f)
    return h


def largest_block(n: int) -> int:
    """The largest order b dividing n whose Hadamard matrix can be built: n itself where it can (1 for odd n)."""
    return max(b for b in range(1, n + 1) if n % b == 0 and construction(b) is not None)


# ---------------------------------------------------------------------------------------------- rotations

@dataclass(frozen=True)
class Rotation:
    """The orthogonal n x n matrix R = D · blockdiag(H(block)/√block, ...), D = diag(signs) drawn from `seed` (None:
    D = I). x ↦ x R rotates a row vector (the channels of the last dimension); R is what `matrix()` returns."""

    size: int
    seed: int | None = None
    block: int = 0  # the order of the Hadamard blocks; 0: the largest that can be built (`size` where it can)

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"rotation size must be positive, got {self.size}")
        b = self.block or largest_block(self.size)
        if self.size % b or construction(b) is None:
            raise ValueError(f"no Hadamard block of order {b} for size {self.size}")
        object.__setattr__(self, "block", b)

    @property
    def full(self) -> bool:
        """One Hadamard matrix of the whole size (not block-diagonal)."""
        return self.block == self.size

    def describe(self) -> str:
        h = describe(construction(self.block))
        where = h if self.full else f"{self.size // self.block} blocks of {h}"
        return where + ("" if self.seed is None else f", random signs (seed {self.seed})")

    def signs(self, device=None) -> "torch.Tensor | None":
        """D's diagonal (float64 ±1), None without a seed."""
        if self.seed is None:
            return None
        g = torch.Generator().manual_seed(self.seed)
        return (torch.randint(0, 2, (self.size,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.float64).to(device)

    def apply(self, x: "torch.Tensor", transpose: bool = False) -> "torch.Tensor":
        """x R (or x Rᵀ) over the last dimension, computed in float64 factor by factor; float64 out."""
        if x.shape[-1] != self.size:
            raise ValueError(f"rotation of size {self.size} applied to a last dimension of {x.shape[-1]}")
        y = x.to(torch.float64)
        s = self.signs(y.device)
        if s is not None and not transpose:
            y = y * s
        factors = [f.to(device=y.device, dtype=torch.float64) for f in _factors(construction(self.block))]
        lead = y.shape[:-1]
        y = y.reshape(*lead, self.size // self.block, *(f.shape[0] for f in factors))
        k = len(factors)
        for i, f in enumerate(factors):  # (A ⊗ B)ᵀ = Aᵀ ⊗ Bᵀ: each factor on its own axis
            axis = y.dim() - k + i
            y = torch.movedim(torch.movedim(y, axis, -1) @ (f.T if transpose else f), -1, axis)
        y = y.reshape(*lead, self.size) / math.sqrt(self.block)
        if s is not None and transpose:
            y = y * s
        return y

    def matrix(self, dtype=None) -> "torch.Tensor":
        """R, dense [size, size] (float64 unless dtype)."""
        r = self.apply(torch.eye(self.size, dtype=torch.float64))
        return r if dtype is None else r.to(dtype)

    def to_json(self) -> dict:
        return {"size": self.size, "seed": self.seed, "block": self.block}

    @classmethod
    def from_json(cls, d) -> "Rotation":
        return cls(int(d["size"]), None if d.get("seed") is None else int(d["seed"]), int(d.get("block") or 0))


@dataclass(frozen=True)
class RepeatedRotation:
    """One orthogonal R of order `inner.size` applied to each block of that many channels of a `size`-wide vector:
    blockdiag(R, ..., R). This is the form an engine applies online (compressed-tensors' transforms take one matrix,
    repeated over the blocks when its `head_dim` is smaller than the width), so a rotation written for run time is
    one of these, never a Rotation whose random signs differ from block to block. inner.size == size: R itself."""

    size: int
    inner: Rotation

    def __post_init__(self):
        if self.size % self.inner.size:
            raise ValueError(f"a rotation of order {self.inner.size} does not tile a width of {self.size}")
        if not self.inner.full:
            raise ValueError(f"the repeated rotation must be one Hadamard matrix, not {self.inner.describe()}")

    @property
    def block(self) -> int:
        return self.inner.size

    def apply(self, x: "torch.Tensor", transpose: bool = False) -> "torch.Tensor":
        """x blockdiag(R, ...) over the last dimension (float64 out)."""
        if x.shape[-1] != self.size:
            raise ValueError(f"rotation of size {self.size} applied to a last dimension of {x.shape[-1]}")
        lead = x.shape[:-1]
        y = self.inner.apply(x.reshape(*lead, self.size // self.block, self.block), transpose)
        return y.reshape(*lead, self.size)

    def stored(self, dtype=None) -> "torch.Tensor":
        """√b R: the ±1 matrix [b, b] a compressed-tensors Hadamard transform stores (the engine divides it by √b)."""
        m = (self.inner.matrix() * math.sqrt(self.block)).round()
        return m if dtype is None else m.to(dtype)

    def describe(self) -> str:
        inner = self.inner.describe()
        return inner if self.block == self.size else f"{self.size // self.block} blocks of one {inner}"

    def to_json(self) -> dict:
        return {"size": self.size, "block": self.block, "seed": self.inner.seed}

    @classmethod
    def from_json(cls, d) -> "RepeatedRotation":
        block = int(d.get("block") or d["size"])
        return cls(int(d["size"]), Rotation(block, None if d.get("seed") is None else int(d["seed"])))

    def unit(self) -> "RepeatedRotation":
        """The repeated matrix alone (size = block): what is stored, and what tiles any width it divides."""
        return RepeatedRotation(self.block, self.inner)

    def tiling(self, width: int) -> "RepeatedRotation":
        """The same repeated matrix over another width (an input of `width` channels)."""
        return RepeatedRotation(width, self.inner)

    @classmethod
    def for_width(cls, width: int, seed: int | None, block: int = 0) -> "RepeatedRotation":
        """The online rotation of a `width`-wide input: one Hadamard of the whole width where one can be built (or of
        `block`), else of the largest order that divides it and can be built, repeated."""
        b = block or largest_block(width)
        if width % b:
            raise ValueError(f"block {b} does not divide the width {width}")
        if construction(b) is None:
            raise ValueError(f"no Hadamard matrix of order {b} is built here")
        return cls(width, Rotation(b, seed))


def orthogonality_error(m: "torch.Tensor") -> float:
    """max |M Mᵀ / n − I| of a square ±1 (or any) matrix M [n, n], in float64: 0 for a Hadamard matrix."""
    m = m.to(torch.float64)
    n = m.shape[0]
    return float((m @ m.T / n - torch.eye(n, dtype=torch.float64)).abs().max())
