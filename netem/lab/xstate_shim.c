/*
 * moemesh kernel lab: an LD_PRELOAD shim for User-Mode Linux on hosts with AMX.
 *
 * UML restores a guest thread's FPU state with ptrace(PTRACE_SETREGSET, NT_X86_XSTATE) and a
 * buffer of the size of the host's static XSAVE features (2696 bytes with AVX-512). A host
 * kernel with dynamic features (AMX tile data) wants the full buffer there (11008 bytes) and
 * answers any other size with EFAULT; UML then panics at boot ("ptrace set fp regs failed,
 * errno = 14").
 *
 * Here such a call reads the thread's full state first, lays UML's smaller buffer over its
 * start (all the state UML keeps) and writes the full buffer back. The part past UML's size is
 * the dynamic state the thread already had, so nothing UML saved is lost or changed. Every other
 * ptrace call passes through untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <stdarg.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef long (*ptrace_fn)(int, ...);

long ptrace(enum __ptrace_request request, ...)
{
	static ptrace_fn real;
	static __thread unsigned char full[65536] __attribute__((aligned(64)));
	va_list ap;

	va_start(ap, request);
	pid_t pid = va_arg(ap, pid_t);
	void *addr = va_arg(ap, void *);
	void *data = va_arg(ap, void *);
	va_end(ap);
	if (!real)
		real = (ptrace_fn)dlsym(RTLD_NEXT, "ptrace");
	if (request == PTRACE_SETREGSET && (long)addr == NT_X86_XSTATE && data) {
		struct iovec *want = data;
		struct iovec have = { full, sizeof full };

		if (real(PTRACE_GETREGSET, pid, addr, &have) < 0)
			return -1;
		if (want->iov_len < have.iov_len) {
			memcpy(full, want->iov_base, want->iov_len);
			return real(PTRACE_SETREGSET, pid, addr, &have);
		}
	}
	return real(request, pid, addr, data);
}
