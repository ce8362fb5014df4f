/* Test-suite diagnostics: when a process of a test dies on SIGABRT, SIGSEGV, SIGBUS, SIGILL or SIGFPE, print the
 * native stack of the thread that got the signal, then die as before.
 *
 * Why: a rank of a 2-process run has now and then aborted with "terminate called without an active exception"
 * from a C++ thread with no Python frame, so Python's faulthandler (PYTHONFAULTHANDLER) cannot say where. Loaded
 * into the test's child processes through LD_PRELOAD (tests/conftest.py builds it with the C compiler when there is
 * one). Python's faulthandler installs its handler after this one and calls this one after its own dump. */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#define MAX_SIGNAL 32
static struct sigaction previous[MAX_SIGNAL];

static void print_stack(int sig, siginfo_t *info, void *context) {
    (void)info;
    (void)context;
    static const char header[] = "\n*** native stack of the thread that got a fatal signal (tests/native) ***\n";
    void *frames[64];
    ssize_t ignored = write(STDERR_FILENO, header, sizeof header - 1);
    (void)ignored;
    backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
    sigaction(sig, &previous[sig], NULL); /* then the handler before ours, or the default: the process dies as before */
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc's unwinder now: doing it inside the signal handler could allocate */
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = print_stack;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    const int fatal[] = {SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE};
    for (unsigned i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
        sigaction(fatal[i], &action, &previous[fatal[i]]);
}
