"""Tests of infra/: the compose file, the image, the service units, the key bootstrap.

Docker cannot run where these tests run, so the compose file is validated by
`docker-compose config`, the Dockerfile is read statically, and the units are checked
by `systemd-analyze verify` and plistlib; what can run outside a container (the key
bootstrap, the healthcheck command, the launchd agent's script, the test suites'
server variables) is run.
"""
