"""A running batch of a vLLM engine (``LLM.llm_engine``) that outlives each eyas request: requests
are added as eyas sends them, and the engine steps until enough of them have finished."""

from __future__ import annotations


def step_until(engine, low_water: int, seen) -> list:
    """Step ``engine`` until at least one request has finished and at most ``low_water`` are left.
    ``seen(output)`` is called on every output of every step and returns the record of a finished
    request (else None); returns those records."""
    done = []
    while engine.has_unfinished_requests():
        done += [rec for o in engine.step() if (rec := seen(o)) is not None]
        if done and engine.get_num_unfinished_requests() <= low_water:
            break
    return done
