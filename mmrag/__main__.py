# The guard matters: vLLM's CPU backend starts its engine core with the `spawn` method, which re-imports
# __main__ in the child; an unguarded main() would start the CLI again there.
if __name__ == "__main__":
    from mmrag.cli import main

    main()
