from ckptool.cli import run

run()
