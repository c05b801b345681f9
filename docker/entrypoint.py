"""Container entrypoint: hand a stage process its section of the deploy profile, then exec the command.

The embedded launcher (``minicpmo-serve``) gives every stage process its resolved profile section in
``MINICPMO_STAGE_SETTINGS``. In a container the stage is started by the runtime instead, so this wrapper
does the same from two variables that compose and the Helm chart set:

* ``MINICPMO_DEPLOY_PROFILE``: a profile file (the chart's ConfigMap, or configs/deploy/ mounted by compose)
  or the name of a bundled profile;
* ``MINICPMO_STAGE``: which stage this container runs.

It uses the project's own parser (``services.common.deploy_profile``), so a malformed profile stops the
container at start with the parser's message instead of surfacing later as a wrong memory share.
A value already in ``MINICPMO_STAGE_SETTINGS`` wins; without the two variables the command runs unchanged.
"""

from __future__ import annotations

import os
import sys


def stage_settings(profile_ref: str, stage: str) -> str:
    """The JSON the launcher would pass ``stage`` for the profile ``profile_ref``."""
    from services.common.deploy_profile import load_profile

    return load_profile(profile_ref).stage(stage).settings_json()


def prepare_environment(env: dict[str, str]) -> dict[str, str]:
    """Return ``env`` with MINICPMO_STAGE_SETTINGS filled in where a profile and a stage are named."""
    from services.common.deploy_profile import STAGE_SETTINGS_ENV, STAGES

    profile_ref = env.get("MINICPMO_DEPLOY_PROFILE")
    stage = env.get("MINICPMO_STAGE")
    if not profile_ref or stage not in STAGES or env.get(STAGE_SETTINGS_ENV):
        return env
    return {**env, STAGE_SETTINGS_ENV: stage_settings(profile_ref, stage)}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: entrypoint.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        env = prepare_environment(dict(os.environ))
    except ValueError as exc:  # ProfileError is a ValueError
        print(f"entrypoint: deploy profile rejected: {exc}", file=sys.stderr)
        return 2
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
