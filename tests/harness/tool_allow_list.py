"""The operator allow-list of tool modules (`slipstream cluster up --tool-modules`) that the tool-impl tests
give the check, the rollout workers and their cluster."""

ALLOWED = ["generator_fleet.tools.examples"]
