from ckptool.cli import main

main()
