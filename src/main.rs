fn main() -> std::process::ExitCode {
    queueguard::cli::main()
}
