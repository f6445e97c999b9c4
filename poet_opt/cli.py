def main():
    raise SystemExit('cli not yet built')
