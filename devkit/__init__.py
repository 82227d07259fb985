"""Development kit: the sample corpus and the tiny random-weight model builder. Product code never imports it."""
