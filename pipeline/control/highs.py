"""HiGHS for the planners' linear programs: one solver kept from solve to solve, and its warm start.

:class:`LPSolver` solves ``min c @ z`` subject to ``A_eq @ z = b_eq`` and ``lower <= z <= upper`` with one
:class:`highspy.Highs` (one thread, seed 0, no output). Given keys for the LP's columns and rows (int64, what each one
stands for: equal in two LPs where the variable or the row is the same), it keeps the optimal basis of each solve and
starts the next keyed solve from it: each column and row whose key the last LP had takes its status there, the others
start at their lower bound (columns) or basic (rows); HiGHS completes this alien basis to a basis of the new LP. The
optimum is the same as from a cold start; among plans of equal cost the vertex reached may differ.

References:
    Q. Huangfu and J. A. J. Hall, "Parallelizing the dual revised simplex method", Mathematical Programming
    Computation 10 (2018), 119-142 (HiGHS's dual simplex).
"""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp

COLWISE = int(highspy.MatrixFormat.kColwise)
MINIMIZE = int(highspy.ObjSense.kMinimize)
BASIS_STATUS = np.array([highspy.HighsBasisStatus(i) for i in range(5)], dtype=object)
"""HiGHS's basis statuses by their value: kLower 0, kBasic 1, kUpper 2, kZero 3, kNonbasic 4."""
LOWER, BASIC, UPPER, ZERO = 0, 1, 2, 3
"""The values of :data:`BASIS_STATUS` a basis read off a solution holds."""


@dataclass(frozen=True)
class KeyedBasis:
    """An optimal basis and the keys of its LP's columns and rows: ``(n,)`` and ``(rows,)`` int64 keys, and each
    one's status as an int8 value of :data:`BASIS_STATUS`, ``(n,)`` and ``(rows,)``."""

    col_keys: np.ndarray
    col_status: np.ndarray
    row_keys: np.ndarray
    row_status: np.ndarray


class LPSolver:
    """One HiGHS instance for a run of LPs, warm-started from the last keyed solve (module docstring).

    Args:
        presolve: HiGHS presolve (off: the optimum is the same, the vertex chosen among equal-cost plans may differ).

    Attributes:
        highs: the :class:`highspy.Highs` instance (its info describes the last solve).
        basis: the :class:`KeyedBasis` of the last keyed solve; None before one.
        status: the :class:`highspy.HighsModelStatus` of the last solve.
    """

    def __init__(self, presolve: bool = True):
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("threads", 1)
        if not presolve:
            h.setOptionValue("presolve", "off")
        self.highs = h
        self.basis: KeyedBasis | None = None
        self.status = highspy.HighsModelStatus.kNotset

    def solve(
        self, c: np.ndarray, A_eq: sp.spmatrix, b_eq: np.ndarray, bounds: np.ndarray, keys: tuple | None = None
    ) -> np.ndarray | None:
        """Solve the LP; its solution, or None when HiGHS finds no optimum (:attr:`status` says what it found).

        Args:
            c, A_eq, b_eq, bounds: the objective ``(n,)``, the equality rows ``(rows, n)`` (sparse), their right-hand
                side ``(rows,)`` and the columns' ``[lower, upper]`` ``(n, 2)`` (``inf`` for none).
            keys: ``(column keys, row keys)``, ``(n,)`` and ``(rows,)`` int64: start from :attr:`basis` carried to
                these keys (:func:`carried_basis`; a cold start before any keyed solve, and again cold when the
                carried start does not reach an optimum) and keep this solve's basis; None: a cold start, nothing
                kept.

        Returns:
            the solution, ``(n,)`` float64, or None.
        """
        A = A_eq.tocsc()
        upper = np.where(np.isinf(bounds[:, 1]), highspy.kHighsInf, bounds[:, 1])
        rhs = np.ascontiguousarray(b_eq, np.float64)  # equality rows: lower = upper
        h = self.highs
        h.passModel(  # the arrays overload: no copy through HighsLp's Python properties
            A.shape[1],
            A.shape[0],
            A.nnz,
            COLWISE,
            MINIMIZE,
            0.0,
            np.ascontiguousarray(c, np.float64),
            np.ascontiguousarray(bounds[:, 0]),
            upper,
            rhs,
            rhs,
            A.indptr.astype(np.int32, copy=False),
            A.indices.astype(np.int32, copy=False),
            A.data,
            np.zeros(A.shape[1], np.int32),  # integrality: every column continuous
        )
        warm = keys is not None and self.basis is not None
        if warm:
            h.setBasis(carried_basis(self.basis, keys))
        h.run()
        self.status = h.getModelStatus()
        if warm and self.status != highspy.HighsModelStatus.kOptimal:  # a carried basis that did not help: cold
            h.clearSolver()
            h.run()
            self.status = h.getModelStatus()
        if self.status != highspy.HighsModelStatus.kOptimal:
            return None
        solution = h.getSolution()
        z = np.asarray(solution.col_value)
        if keys is not None:
            col_status, row_status = basis_status(h, solution, z, bounds[:, 0], upper)
            self.basis = KeyedBasis(keys[0], col_status, keys[1], row_status)
        return z

    def status_text(self) -> str:
        """HiGHS's name of :attr:`status` (for error messages)."""
        return self.highs.modelStatusToString(self.status)


def basis_status(
    h: highspy.Highs, solution, z: np.ndarray, lower: np.ndarray, upper: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The optimal basis of the LP ``h`` has just solved, ``(column statuses, row statuses)``, ``(n,)`` and
    ``(rows,)`` int8 values of :data:`BASIS_STATUS`: what ``h.getBasis()`` reports, read off the basic variables and
    the solution (``h.getSolution()``; ``z`` its column values, ``lower`` and ``upper`` the columns' bounds, ``(n,)``
    each, :data:`highspy.kHighsInf` for none) without a Python object per column (about a sixth of the time on
    ``mpc_scenario``'s LPs). A nonbasic column is at its upper bound where its value is there (a fixed column: where
    its dual is negative), free at zero, else at its lower bound; a nonbasic row (every row is an equality) is at its
    upper bound where its dual is positive. ``tests/test_scenario.py`` checks the two readings agree."""
    basic = h.getBasicVariables()[1]
    cols = np.full(len(z), LOWER, np.int8)
    fixed = lower == upper
    free = np.isinf(lower) & np.isinf(upper)
    at_upper = np.where(fixed, np.asarray(solution.col_dual) < 0, z >= upper)
    cols[at_upper] = UPPER
    cols[free] = ZERO
    cols[basic[basic >= 0]] = BASIC
    rows = np.where(np.asarray(solution.row_dual) > 0, UPPER, LOWER).astype(np.int8)
    rows[-1 - basic[basic < 0]] = BASIC
    return cols, rows


def carried_basis(last: KeyedBasis, keys: tuple) -> highspy.HighsBasis:
    """The basis ``last`` carried to an LP with ``keys`` (``(column keys, row keys)``, int64): each column and row whose
    key the last LP had takes its status, the others start at their lower bound (columns) or basic (rows); an alien
    basis, which HiGHS completes to a basis of the LP."""

    def carry(new: np.ndarray, old: np.ndarray, status: np.ndarray, default: int) -> list:
        order = np.argsort(old, kind="stable")
        i = np.minimum(np.searchsorted(old[order], new), len(old) - 1)
        hit = old[order[i]] == new
        out = np.full(len(new), default, np.int8)
        out[hit] = status[order[i[hit]]]
        return BASIS_STATUS[out].tolist()

    basis = highspy.HighsBasis()
    basis.col_status = carry(keys[0], last.col_keys, last.col_status, LOWER)
    basis.row_status = carry(keys[1], last.row_keys, last.row_status, BASIC)
    basis.alien = True
    basis.valid = True
    return basis
