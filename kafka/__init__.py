"""Kafka support that producer and consumer share: client properties (`options`), topic
creation and layout (`topics`), seeking a consumer to a partition's ends (`positions`), the
schema registry client and its local server (`registry/`), and the local broker the CLI and
tests start (`broker/`, `daemon`)."""
