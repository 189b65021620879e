#include <stdio.h>

int add(int a, int b);
int mul(int a, int b);

int main(void) {
    int failed = 0;
    printf("1..2\n");
    if (add(2, 3) == 5) printf("ok 1 - add\n"); else { printf("not ok 1 - add\n"); failed = 1; }
    if (mul(2, 3) == 6) printf("ok 2 - mul\n"); else { printf("not ok 2 - mul\n"); failed = 1; }
    return failed;
}
