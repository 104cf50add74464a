"""The CPUs vLLM binds the model's OpenMP threads to, read from the variables its CPU worker
sets (``vllm/utils/ompmultiprocessing.py``): GNU's ``GOMP_CPU_AFFINITY``, Intel's
``KMP_AFFINITY`` proclist, ``OMP_PLACES``, and an explicit ``VLLM_CPU_OMP_THREADS_BIND``.
Whatever an operator's environment holds, the answer is a set of CPU numbers, never an error
or a set too large to hold: a variable that does not parse binds nothing known."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.store import cpus

CPU_SETS = st.frozensets(st.integers(0, 511), min_size=1, max_size=64)


@pytest.mark.parametrize("environ, expected", [
    ({"GOMP_CPU_AFFINITY": "0 1"}, {0, 1}),
    ({"GOMP_CPU_AFFINITY": "0-3 8"}, {0, 1, 2, 3, 8}),
    ({"GOMP_CPU_AFFINITY": "0-6:2,9"}, {0, 2, 4, 6, 9}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,6,7]"}, {4, 5, 6, 7}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0-2,{5}]"}, {0, 1, 2, 5}),
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, {0, 1, 2, 3}),
    ({"GOMP_CPU_AFFINITY": "0", "VLLM_CPU_OMP_THREADS_BIND": "4|5"}, {0, 4, 5}),
    ({}, set()),
    ({"OMP_PLACES": "cores"}, set()),
    ({"OMP_PLACES": "{0}:4"}, set()),
    ({"KMP_AFFINITY": "compact"}, set()),
    ({"KMP_AFFINITY": "explicit,proclist=[0,1"}, set()),
    ({"GOMP_CPU_AFFINITY": "0 x"}, set()),
    ({"GOMP_CPU_AFFINITY": "3-1"}, set()),
    ({"GOMP_CPU_AFFINITY": "0-8:0"}, set()),
    ({"GOMP_CPU_AFFINITY": "\u00b2"}, set()),  # a digit to str.isdigit, not to int()
    ({"GOMP_CPU_AFFINITY": "0-4294967295"}, set()),  # no machine has it: not four billion CPUs
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, set()),
])
def test_the_cpus_vllm_binds_openmp_threads_to(environ, expected):
    assert cpus.note_spinning_cpus(environ) == expected
    assert cpus.spinning_cpus() == expected
    cpus.note_spinning_cpus({})


@given(CPU_SETS)
def test_every_form_vllm_writes_reads_back(cpu_set):
    listed = sorted(cpu_set)
    for environ in ({"GOMP_CPU_AFFINITY": " ".join(map(str, listed))},
                    {"KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{','.join(map(str, listed))}]"},
                    {"OMP_PLACES": "{" + ",".join(map(str, listed)) + "}"}):
        assert cpus.omp_env_cpus(environ) == cpu_set, environ


@given(st.dictionaries(st.sampled_from(["GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES",
                                        "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"]),
                       st.text(alphabet="0123456789-:,{}[]| =abcprolist\u00b2\u0661", max_size=40)))
def test_any_environment_gives_a_small_set_of_cpus(environ):
    found = cpus.note_spinning_cpus(environ)
    cpus.note_spinning_cpus({})
    assert isinstance(found, frozenset)
    assert all(isinstance(c, int) and 0 <= c < 1 << 16 for c in found)
