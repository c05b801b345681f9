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

TLS files reach a container as environment variables (compose/tls.yml, the Helm chart's secrets); the
services themselves take flags only, so :func:`command_with_tls` appends the matching ``--tls-*`` flags
to a stage's command and ``--stage-tls-*`` to the gateway's (a flag already on the command wins).
"""

from __future__ import annotations

import os
import shlex
import sys

# Environment variable -> flag, for a stage's command and for the gateway's.
STAGE_TLS = (
    ("MINICPMO_TLS_CERT", "--tls-cert"),
    ("MINICPMO_TLS_KEY", "--tls-key"),
    ("MINICPMO_TLS_CLIENT_CA", "--tls-client-ca"),
)
GATEWAY_TLS = (
    ("MINICPMO_STAGE_TLS_CA", "--stage-tls-ca"),
    ("MINICPMO_STAGE_TLS_CERT", "--stage-tls-cert"),
    ("MINICPMO_STAGE_TLS_KEY", "--stage-tls-key"),
)


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


def command_with_tls(argv: list[str], env: dict[str, str]) -> list[str]:
    """``argv`` with the TLS flags its environment names: a ``python -m services.<stage>`` or
    ``python -m gateway`` command (exec form, or the last command of an ``sh -c`` script, as the
    Dockerfile's default commands are) gets the flags it does not already have."""
    script = len(argv) == 3 and argv[0].endswith("sh") and argv[1] == "-c"
    words = shlex.split(argv[2]) if script else argv
    if "-m" not in words[:-1]:
        return argv
    module = words[words.index("-m") + 1]
    pairs = GATEWAY_TLS if module == "gateway" else STAGE_TLS if module.startswith("services.") else ()
    extra: list[str] = []
    for var, flag in pairs:
        if env.get(var) and flag not in words:
            extra += [flag, env[var]]
    if not extra:
        return argv
    if script:
        return [argv[0], argv[1], argv[2] + " " + " ".join(shlex.quote(a) for a in extra)]
    return [*argv, *extra]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: entrypoint.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        env = prepare_environment(dict(os.environ))
    except ValueError as exc:  # ProfileError is a ValueError
        print(f"entrypoint: deploy profile rejected: {exc}", file=sys.stderr)
        return 2
    argv = command_with_tls(argv, env)
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
