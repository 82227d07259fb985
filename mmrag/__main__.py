from mmrag.cli import main

main()
