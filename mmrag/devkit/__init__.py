"""Development kit: the sample corpus, the tiny random-weight model builder, and free ports for the servers tests
and benchmarks start. Product code never imports it."""
